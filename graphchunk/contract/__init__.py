"""graphchunk's contract with vLLM: every vLLM name graphchunk relies on, and the check of that
list against a vLLM release.

- ``names``: the contract itself, as data (``Name``, ``NAMES``, ``KINDS``, ``SCOPES``).
- ``params``: parameter lists and their matching against an entry, what a lookup finds, and the
  ``ast`` scans both resolvers share.
- ``source``: ``SourceResolver``, an unpacked vLLM source tree read with ``ast`` (nothing imported).
- ``installed``: ``ImportResolver``, the installed vLLM imported and inspected.
- ``check``: each entry checked against a resolver, the report and its JSON record, and the
  command ``python -m graphchunk.contract.check [--source DIR] ...``.
"""
