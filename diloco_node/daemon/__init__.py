"""The node's process (`diloco-node join`): start-up, round loop, checkpoints, stop signals, the composition root."""
