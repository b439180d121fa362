"""Data files shipped with specdec (token frequency tables: :mod:`specdec.models.vocab_subset`)."""
