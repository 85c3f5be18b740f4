"""Packages are found, not listed: the core and the top-level ``flows``, ``tasks`` and
``deployments`` folders, installed under the one import package ``rollout_capture``."""

from setuptools import find_namespace_packages, find_packages, setup

MAPPED = ("flows", "tasks", "deployments", "cli")  # repository folders -> rollout_capture.<name>

packages = find_packages(include=["rollout_capture", "rollout_capture.*"])
# The NeMo Gym model server's folder (found by NeMo Gym through --search-dir, no __init__.py):
# listed, so setuptools installs it as the package it can be imported as, not as stray data
# (it warned that such a folder "would be ignored").
packages += find_namespace_packages(include=["rollout_capture.producer.nemo_gym_servers*"])
# The bundled sample (`make demo`, the docs' examples): data folders, listed for the same reason.
packages += find_namespace_packages(include=["rollout_capture.sample*"])
package_dir = {}
for top in MAPPED:
    package_dir[f"rollout_capture.{top}"] = top
    packages += [f"rollout_capture.{name}" for name in find_packages(include=[top, f"{top}.*"])]

setup(packages=packages, package_dir=package_dir)
