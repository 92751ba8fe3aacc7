"""Gluon plumbing that no single architecture owns: Gluon's names on every supported triton (``compat``), the
fallback when a Gluon kernel does not build (``availability``), offline builds for a target given as an argument
(``build``). The building blocks of warp-specialised Hopper kernels, shared by attention and MoE, are ``sm90``."""
