"""The Hopper (sm_90) attention backend: `backend.py` (what it takes, its plans, how they run), `tiles.py` (its tile
and schedule heuristics), and the Gluon kernels (fwd_sm90: forward; bwd_sm90, bwd_dq_sm90, bwd_sm90_hdim256:
backward; bwd_common, work_items: their shared pieces)."""
