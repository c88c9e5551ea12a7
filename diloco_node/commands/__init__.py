"""The command line's commands beyond `join`: the demo, export, the status view, and the one launcher of nodes."""
