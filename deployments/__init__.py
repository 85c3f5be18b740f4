"""Deployments of the flows: prefect.yaml (work pools) and serve.py (this machine)."""
