"""Deployments: the shipped definitions (``shipped``), ``rollout-capture deploy``, ``serve``."""
