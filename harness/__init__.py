"""The test and benchmark harness: what tests/ and benchmarks/ share, outside the node's package.

- nodes.py: real `diloco-node join` nodes through the one launcher (diloco_node/commands/launch.py), their
  flags, swarms of them on loopback, and what their events say;
- islands.py: a wide-area network on one machine (network namespaces, rate-limited links) and nodes
  inside it;
- docker.py: a real Docker engine and docker/compose.yaml's islands on it;
- wire.py: the one wire sampler (the kernel's interface byte counters);
- ddp.py: the data-parallel baseline, on loopback or across two islands;
- bench.py: whole benchmark runs, scratch folders, machine info, plots.

Installed with the project (`pip install -e '.[test,bench]'`), so tests and benchmark scripts import
it without editing sys.path. Nothing under diloco_node/ imports it.
"""
