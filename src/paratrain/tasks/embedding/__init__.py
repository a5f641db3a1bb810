"""Sentence embeddings and SetFit: the pair records, pooling and the contrastive losses."""
