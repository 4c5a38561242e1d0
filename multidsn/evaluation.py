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
