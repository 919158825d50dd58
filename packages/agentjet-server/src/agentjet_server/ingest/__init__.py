"""What comes in and how it is kept: request bodies read within bounds (``bodies``, with large ones judged
in a process of their own, ``body_gate``), samples signed as they are served and checked when they come
back (``signing``), pushed trajectories admitted or rejected (``store``) and written to the write-ahead log
before they are acknowledged (``wal``). Light on purpose: the body gate's process imports it without torch.
"""
