"""Harnesses for tests and benchmarks: a cluster of real processes (``launch.ProcessCluster``)
and emulated hosts in network namespaces (``netns.NetLab``), and the in-process cluster on virtual
time (``inproc.InprocCluster``) that tests and ``laminar simulate run`` use. Nothing a deployment
runs imports this package."""
