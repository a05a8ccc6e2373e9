"""Builds the rawref C extension (the only native piece needed in fast mode)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("rawref._rawref", ["rawref/_rawref.c"], extra_compile_args=["-O2", "-Wall"])])
