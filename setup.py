"""The packages the wheel installs, and the run configs as package data.

The YAML run configs live in the repository's top-level ``configs/`` (where an engine's
author looks for them); the wheel installs them as ``dsv32_engine/configs`` so that
``--config NAME`` works from an installed wheel. A folder outside the package tree can only
be mapped into it here: ``[tool.setuptools.packages.find]`` in pyproject.toml finds
packages by walking folders, and cannot add a mapped one to what it finds. Everything else
about the build is in pyproject.toml.
"""

from setuptools import find_namespace_packages, setup

setup(
    packages=[
        *find_namespace_packages(include=["planner*", "backends*", "graphs*", "dsv32_engine*"]),
        "dsv32_engine.configs",
    ],
    package_dir={"dsv32_engine.configs": "configs"},
    package_data={"dsv32_engine.configs": ["*.yaml"]},
)
