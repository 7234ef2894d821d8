"""What the target families share."""

from __future__ import annotations


def upcast_weights_on_use(module, skip: tuple[str, ...] = ()):
    """Make every non-fp32 parameter of `module` (except `skip`) read as fp32 (a parametrization: the
    stored tensor stays as it is and each use makes a transient fp32 copy), so a bf16 checkpoint
    gives the fp32 reference without an fp32 copy of the whole model."""
    import torch
    from torch.nn.utils import parametrize

    class Fp32(torch.nn.Module):
        def forward(self, w):
            return w.to(torch.float32)

    for name, p in list(module.named_parameters()):
        if p.dtype != torch.float32 and name not in skip:
            owner, _, leaf = name.rpartition(".")
            parametrize.register_parametrization(module.get_submodule(owner) if owner else module, leaf, Fp32(),
                                                 unsafe=True)
    return module
