"""Accuracy per domain and the private-code collapse check, for a local or a distributed DSN."""

from __future__ import annotations

from .data import Domain


def accuracy(model, domain: Domain, index: int) -> float | None:
    """Test accuracy of G(E_c(x)) on a domain's labelled test split (None when it has no labels)."""
    if domain.test_y is None or len(domain.test_y) == 0:
        return None
    pred = model.predict(domain.test_x, domain=index).argmax(1)
    return float((pred == domain.test_y).float().mean())


def private_code_report(model, domains: list[Domain], ratio: float, images: int = 256) -> dict:
    """Norms of the private against the shared codes per domain, and the collapse verdict.

    Collapse (a known DSN failure): the private encoders output ~0, so the difference loss reads ~0 for
    free, the decoder works from the shared code alone and the model is just DANN or MMD. Flagged when
    every domain's mean private-code norm is below ``ratio`` times its mean shared-code norm.
    """
    norm_ratio, private_norm = [], []
    for d, dom in enumerate(domains):
        h_c, h_p = model.codes(dom.test_x[:images], d)
        p, c = float(h_p.norm(dim=1).mean()), float(h_c.norm(dim=1).mean())
        private_norm.append(p)
        norm_ratio.append(p / max(c, 1e-12))
    return {"private_norm": private_norm, "norm_ratio": norm_ratio, "threshold": ratio,
            "collapsed": all(r < ratio for r in norm_ratio)}


def accuracy_by_polarity(model, domain: Domain, index: int) -> dict | None:
    """{"light": accuracy on the test images whose strokes are brighter than their background, "dark": on the
    others, "light_count", "dark_count"}; None when the domain does not record polarity."""
    if domain.test_light is None or domain.test_y is None:
        return None
    correct = model.predict(domain.test_x, domain=index).argmax(1) == domain.test_y
    out = {}
    for name, mask in (("light", domain.test_light), ("dark", ~domain.test_light)):
        out[name] = float(correct[mask].float().mean()) if bool(mask.any()) else None
        out[f"{name}_count"] = int(mask.sum())
    return out


def domain_probe_accuracy(model, source: Domain, target: Domain, index: int, steps: int = 300,
                          seed: int = 0) -> float:
    """How well the shared codes still tell source from target: a logistic regression trained on the shared
    codes of half of each test split, scored on the other half (0.5 = indistinguishable). It reads every
    method alike, those without a domain classifier too."""
    import torch

    n = min(len(source.test_x), len(target.test_x))
    codes = [model.codes(d.test_x[:n], i)[0].float() for d, i in ((source, 0), (target, index))]
    x = torch.cat(codes)
    x = (x - x.mean(0)) / x.std(0).clamp_min(1e-6)
    y = torch.cat([torch.zeros(n), torch.ones(n)])
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(2 * n, generator=g)
    train, test = order[: n], order[n:]
    w = torch.zeros(x.shape[1], requires_grad=True)
    b = torch.zeros(1, requires_grad=True)
    opt = torch.optim.Adam([w, b], lr=0.05)
    with torch.enable_grad():
        for _ in range(steps):
            opt.zero_grad()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(x[train] @ w + b, y[train])
            loss.backward()
            opt.step()
    with torch.no_grad():
        return float((((x[test] @ w + b) > 0).float() == y[test]).float().mean())
