"""Preference training (DPO, KTO, ORPO, SimPO, reward models): the pair and KTO records, the reference cache, the losses."""
