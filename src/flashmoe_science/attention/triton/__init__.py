"""The portable Triton attention backend, the walk's family after the architecture packages': `backend.py` (what it
takes, its plans, how they run; its tiles come from `attention/tiles.py`), and the Triton kernels (fwd: forward;
bwd: backward; fp8: the e4m3 quantisation and forward; decode: the KV-cache kernels `attention.decode` launches;
common: what fwd, bwd, fp8 and `attention/bwd_prep.py` share). It takes every feature of `features.FEATURES` and
head dims 1 to 256 in bf16/fp16/fp32 on any CUDA GPU, and CPU tensors under TRITON_INTERPRET=1 when asked for by
name. The package is named for the language: the modules import the real `triton` by absolute import."""
