"""Builds the two small C extensions (the only native pieces needed in fast mode): rawref
(non-owning references, GC untracking) and blockhash (chained SHA-256 through hashlib's libcrypto)."""

from setuptools import Extension, setup

FLAGS = ["-O2", "-Wall"]
setup(
    ext_modules=[
        Extension("rawref._rawref", ["rawref/_rawref.c"], extra_compile_args=FLAGS),
        Extension("blockhash._blockhash", ["blockhash/_blockhash.c"], extra_compile_args=FLAGS, libraries=["dl"]),
    ]
)
