package torchproc

import "syscall"

// setParentDeathSignal makes the kernel stop the worker when the host dies without closing it
// (killed, crashed), so no orphan keeps a GPU.
func setParentDeathSignal(a *syscall.SysProcAttr) { a.Pdeathsig = syscall.SIGTERM }
