"""The architecture the Gluon kernels here are written for (warp specialisation, TMA, wgmma): the name their
backend families compare with `device.DeviceTraits.arch`, and their offline builds target."""

ARCH = "sm_90"
