"""Tools beside the training path: `paratrain bench`, the plain-DDP reference loop,
`paratrain doctor`."""
