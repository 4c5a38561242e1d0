"""Which worker holds which part of a DSN, and where each loss is computed (pure; no RPC).

Placements (``kind``):
- ``"domain"``: worker d holds domain d's private encoder and a shared-encoder replica (d = 0 is the
  source). K + 1 workers, plus the head worker when it is separate.
- ``"encoder"`` (the ORNL Multi-DSN layout): every shared-encoder replica and every private encoder has a
  worker of its own: workers 0..K hold the shared replicas of domains 0..K, workers K+1..2K+1 the private
  encoders. 2(K + 1) workers, plus the head worker when it is separate.

``decoder``:
- ``"domain"``: a decoder replica sits with each private encoder; the reconstruction loss of a domain is
  computed there and only a scalar travels, so the head worker does not grow with K.
- ``"head"``: one decoder on the head worker; the private codes travel to it and it reconstructs every
  domain (its memory grows with K).

``head`` (the classifier, the DANN domain classifier, the task and similarity losses):
- ``"separate"``: a worker of its own (the last one used), as in the ORNL layout.
- ``"source"``: on worker 0 (the source's shared-encoder replica), saving one worker.

The difference loss of a domain is computed where its private code is made; the shared code is sent
there when it is made elsewhere. Replicated modules (the shared encoder; the decoder with
``decoder="domain"``) keep equal weights by summing their gradients over a process group of their holders.
"""

from __future__ import annotations

from dataclasses import dataclass

PLACEMENTS = ("domain", "encoder")
DECODERS = ("domain", "head")
HEADS = ("separate", "source")


@dataclass(frozen=True)
class Placement:
    kind: str
    decoder: str
    head: str
    num_domains: int
    has_domain_classifier: bool

    def __post_init__(self) -> None:
        for value, name, options in ((self.kind, "placement", PLACEMENTS), (self.decoder, "decoder", DECODERS),
                                     (self.head, "head", HEADS)):
            if value not in options:
                raise ValueError(f"{name} must be one of {options}, got {value!r}")

    # -- where things are --------------------------------------------------------------------------
    @property
    def _encoder_workers(self) -> int:
        return self.num_domains if self.kind == "domain" else 2 * self.num_domains

    @property
    def workers_needed(self) -> int:
        return self._encoder_workers + (1 if self.head == "separate" else 0)

    def shared_worker(self, domain: int) -> int:
        return domain

    def private_worker(self, domain: int) -> int:
        return domain if self.kind == "domain" else self.num_domains + domain

    @property
    def head_worker(self) -> int:
        return self._encoder_workers if self.head == "separate" else 0

    @property
    def decoder_local(self) -> bool:
        return self.decoder == "domain"

    def modules(self, worker: int) -> list[str]:
        """Names (as in ``DSN.state_dict`` prefixes) of the modules that ``worker`` holds, sorted."""
        names = set()
        for d in range(self.num_domains):
            if self.shared_worker(d) == worker:
                names.add("shared_encoder")
            if self.private_worker(d) == worker:
                names.add(f"private_encoders.{d}")
                if self.decoder_local:
                    names.add("decoder")
        if worker == self.head_worker:
            names.add("classifier")
            if self.has_domain_classifier:
                names.add("domain_classifier")
            if not self.decoder_local:
                names.add("decoder")
        return sorted(names)

    def holders(self, module: str) -> list[int]:
        return [w for w in range(self.workers_needed) if module in self.modules(w)]

    def groups(self) -> dict[str, list[int]]:
        """Replicated modules and the workers whose gradients are summed for them, by module name."""
        out = {"shared_encoder": self.holders("shared_encoder")}
        if self.decoder_local:
            out["decoder"] = self.holders("decoder")
        return {name: ranks for name, ranks in sorted(out.items()) if len(ranks) > 1}

    def describe(self) -> str:
        rows = [f"worker{w}: {', '.join(self.modules(w))}" for w in range(self.workers_needed)]
        return f"placement={self.kind!r} decoder={self.decoder!r} head={self.head!r}\n  " + "\n  ".join(rows)


def workers_needed(num_targets: int, placement: str = "domain", head: str = "separate") -> int:
    """Workers a placement uses for K = ``num_targets`` targets (the decoder mode does not change it)."""
    return Placement(placement, "domain", head, num_targets + 1, False).workers_needed
