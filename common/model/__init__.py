"""The model's description, computed alike by the coordinator and the stage servers: its
shape, every parameter's unsharded shape and tensor split, the architectures' blocks and
norms as shapes, and which blocks recompute. No torch: the modules built from it live in
stageserver/model/."""
