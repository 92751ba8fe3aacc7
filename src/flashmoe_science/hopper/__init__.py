"""What every Gluon kernel for Hopper (sm_90) shares, attention and MoE alike (``common``): the register split of a
warp-specialised kernel, launch options, wgmma accumulator layouts, TMA descriptors and offline sm_90 builds."""
