import pytest
import torch

from edge_agent.optim import LocalSGD


@pytest.mark.parametrize("momentum,weight_decay", [(0.0, 0.0), (0.9, 0.0), (0.9, 1e-3), (0.0, 1e-2)])
def test_local_sgd_matches_torch_sgd(momentum, weight_decay):
    torch.manual_seed(0)
    a = torch.nn.Linear(5, 3)
    b = torch.nn.Linear(5, 3)
    b.load_state_dict(a.state_dict())
    ours = LocalSGD(list(a.parameters()), lr=0.1, momentum=momentum, weight_decay=weight_decay)
    reference = torch.optim.SGD(b.parameters(), lr=0.1, momentum=momentum, weight_decay=weight_decay)
    for step in range(5):
        x = torch.randn(8, 5, generator=torch.Generator().manual_seed(step))
        for model, opt in ((a, ours), (b, reference)):
            opt.zero_grad()
            model(x).pow(2).sum().backward()
            opt.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.allclose(p, q, atol=1e-6)
