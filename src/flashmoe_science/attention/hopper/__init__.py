"""The Gluon sm_90 attention kernels (fwd_sm90: forward; bwd_sm90, bwd_dq_sm90, bwd_sm90_hdim256: backward).

What they take, declared once (see attention/features.py for the words): a call with any other feature runs the
portable Triton kernels on Hopper too, and `describe_dispatch` says which feature sent it there. A kernel that
learns a feature adds its word here (and reads the feature's arguments from `CallFeatures`).
"""

SM90_FORWARD_FEATURES = frozenset({"causal"})
SM90_BACKWARD_FEATURES = frozenset({"causal"})
