"""float8kit under torch.distributed: FSDP2 float8 all-gather (``fsdp``),
tensor and sequence parallel styles (``tp``) and the float8 gradient reduce-scatter
(``reduce_scatter``, qgZ). These modules import the core; the core never imports them."""
