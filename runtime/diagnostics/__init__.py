"""What the engine says about itself while serving: nothing here changes what it computes.

`fallbacks` keeps each fallback the engine took with its first reason (for `/admin/api/state`);
`gc_watch` times the garbage collector's pauses and keeps start-up objects and token lists out
of its sight; `compile_watch` counts kernel variants compiled after start-up; `profiling` runs
the torch profiler over a number of steps on demand (`POST /admin/api/profile`), and
`profile_trace` reads its chrome trace into summary rows in a process of its own
(`python -m runtime.diagnostics.profile_trace`).
"""
