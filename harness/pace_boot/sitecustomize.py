"""Run by Python at start-up in a node that harness/pace.py started: paces its inner steps."""

from harness.pace import install_from_environment

install_from_environment()
