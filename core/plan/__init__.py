"""Capacity planner and cost model (``inferhal plan``): from a model config, a device profile, a parallel
layout and a traffic shape to memory per device, the largest batch and context that fit, roofline step
times (HBM bytes, FLOPs per dtype, EP all-to-all over the device's links), MTP drafts with an acceptance
rate, tok/s per device against tok/s per user, $/Mtok and revenue per device-hour.

Files: ``inventory`` (a model's tensors, weight formats, KV and attention costs per token, by family),
``hardware`` (the device: a backend's ``device_catalog`` extra, or this host measured), ``roofline``
(one step's time from bytes, FLOPs and links), ``deploy`` (memory, fit, the batch sweep, cost),
``calibrate`` (published anchors and recorded host runs against the planner), ``report`` (table, plot).
Everything is plain arithmetic on data: no model is built, no device touched.
"""
