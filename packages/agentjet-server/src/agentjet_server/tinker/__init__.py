"""The Tinker API's server side: training code written for Tinker (the ``tinker`` SDK and the tinker-cookbook)
trains on this server's model. ``wire``: the SDK's request and answer formats (protobuf where it uses it);
``losses``: Tinker's built-in losses; ``futures``: operations answered later; ``store``: sessions, sampled
sequences and checkpoints; ``workbench``: the frozen base with an adapter per training client and per sampler
snapshot, and the thread everything runs on; ``sampling``: generation; ``service``: the operations, checked.
The routes are ``api/tinker.py``; docs/tinker.md says what is supported and what differs from the hosted
service.
"""
