"""Layer 6, the runtime: processes, devices and sockets.

``world`` (the driver's ``World``), ``worker`` (a worker process's loop and RPC entry points),
``replica`` (a worker's copy of one model, on the transport its driver chose), ``agent`` (device and
RPC agent settings every process shares), ``netbind`` and ``launch_env`` (sockets and launchers),
``spmd_world`` and ``spmd_launch`` (the SPMD mode's process groups and local launcher).
"""
