"""Which packages the distribution holds: ``swan_dist`` and every subpackage, found by setuptools, and the
framework adapters in ``integrations/`` installed as ``swan_dist.integrations`` (metadata and package data
in setup.cfg)."""

from setuptools import find_packages, setup

adapters = ["swan_dist.integrations"] + [f"swan_dist.integrations.{p}" for p in find_packages("integrations")]
setup(
    packages=find_packages(include=["swan_dist", "swan_dist.*"]) + adapters,
    package_dir={"swan_dist.integrations": "integrations"},
)
