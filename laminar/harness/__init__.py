"""Harnesses for tests and benchmarks: a cluster of real processes (``launch.ProcessCluster``)
and emulated hosts in network namespaces (``netns.NetLab``). Nothing a deployment runs imports
this package."""
