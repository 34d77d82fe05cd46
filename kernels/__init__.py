"""Fused tensor math for the hot paths (installed as ``flowalign.kernels``).

Never install this folder as a top-level ``kernels`` package: transformers and diffusers probe for the Hugging Face
``kernels`` hub package under that import name (DESIGN.md §2).
"""
