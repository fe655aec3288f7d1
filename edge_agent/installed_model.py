"""The model a release names, as this machine builds it: refused when it cannot, or builds another."""

from __future__ import annotations

import torch

from edgefl_protocol import messages
from edgefl_protocol.errors import Rejected
from edgefl_models.architectures import ModelError, build_model, fingerprint


def installed_model(release: messages.ModelRelease) -> torch.nn.Module:
    """The release's model as installed here; refused (Rejected) when this machine cannot build it
    or builds a different one (another version of the user's package)."""
    try:
        model = build_model(release.arch)
    except ModelError as exc:
        raise Rejected("unknown_model", str(exc)) from None
    if release.fingerprint and fingerprint(model) != release.fingerprint:
        names = ", ".join(f"{n} {tuple(p.shape)}" for n, p in list(model.named_parameters())[:3])
        raise Rejected("model_mismatch", f"the installed {release.arch} ({names}, ...) differs from the "
                                         f"coordinator's (fingerprint {fingerprint(model)[:12]} vs "
                                         f"{release.fingerprint[:12]}): install the same version of the "
                                         "model's package here and on the coordinator")
    return model
