"""Layer 4, op rules: what each torch operation means on spatial shards.

``shards`` holds the marks a shard's tensors carry and the helpers every rule uses, ``dims`` the
dim arithmetic they share; ``layout``, ``reduce``, ``window`` and ``norm`` each export constant
tables of rules; ``table`` merges them into one frozen table (a function claimed twice raises);
``mode`` is the ``ShardMode`` that dispatches every call of an unchanged ``forward`` to its rule.
``support`` says which module types a model may hold. Rules see the mode as a ``context.RuleContext``
and never import ``mode`` (which imports them); no transport import: they talk to an executor whose
every member they call is declared in ``context.Executor``.
"""
