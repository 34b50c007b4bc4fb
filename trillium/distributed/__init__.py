"""torch.distributed recipes shared by the engine and the programs that talk
to it (a trainer), importing only torch and the standard library.

    update_group.py  the weights update group: forming it, broadcasts, closing it
"""
