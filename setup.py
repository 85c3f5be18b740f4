"""Packages are found, not listed: the core and the top-level ``flows``, ``tasks`` and
``deployments`` folders, installed under the one import package ``rollout_capture``."""

from setuptools import find_packages, setup

MAPPED = ("flows", "tasks", "deployments", "cli")  # repository folders -> rollout_capture.<name>

packages = find_packages(include=["rollout_capture", "rollout_capture.*"])
package_dir = {}
for top in MAPPED:
    package_dir[f"rollout_capture.{top}"] = top
    packages += [f"rollout_capture.{name}" for name in find_packages(include=[top, f"{top}.*"])]

setup(packages=packages, package_dir=package_dir)
