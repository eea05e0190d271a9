"""The package list, beside pyproject.toml (which holds everything else).

``examples/`` stays at the top of the repository (commands in the docs and ``make demo`` name
``examples/...``) and is installed as ``plainrl.examples``, so a wheel carries the example
configs and the files they name: ``plainrl examples`` lists them, ``plainrl train NAME`` runs one.
A ``packages.find`` directive in pyproject.toml cannot add a package mapped from another
directory, hence this file.
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["plainrl", "plainrl.*"]), "plainrl.examples"],
    package_dir={"plainrl.examples": "examples"},
)
