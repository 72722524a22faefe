"""Build hook: compiles the C expert executor (``freetoken_sglang._cpu_executor``) with cffi;
everything else is in pyproject.toml."""

from setuptools import setup

setup(cffi_modules=["freetoken_sglang/_cpu_executor_build.py:ffibuilder"])
