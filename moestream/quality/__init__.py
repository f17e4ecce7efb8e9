"""Quality gates: perplexity with its standard error, greedy token flips against an fp32 oracle
(margin rule), KL divergence; `evaluate` runs a candidate and the oracle over one text."""
