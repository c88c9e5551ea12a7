"""Whom to believe: the rules about peers, in one package (docs/architecture.md §9 maps them,
and names the few checks still made where the bytes are).

It imports neither hivemind nor torch nor swarm/, outer/ or codec/ (docs/architecture.md §8):
the transport asks it, and acts on its answers.

- admission.py: a permissioned run's owner key, admission and revocation tokens, the Gate
- peer_ids.py: which key speaks for which peer id
- records.py: the presence record's schema, and what the counted records decide together
- proofs.py: proven peers, anchors and newcomers: whose records count
- seals.py: owner seals on averaged butterfly parts, and which sealed versions of a part count
- state.py: whose state to take: servers in order, their metadata, the rounds they may name
- view.py: the run as we believe it: who decides the barrier, "behind" and the state; whom we
  wait for and whom we matchmake with (RunView)
- work.py: whether a payload's declared tokens are believed (DeclaredWork)
"""
