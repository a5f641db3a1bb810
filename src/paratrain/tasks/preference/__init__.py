"""Preference training (DPO, KTO, reward models): the pair and KTO records, the reference cache, the losses."""
