//go:build unix && !linux

package torchproc

import "syscall"

func setParentDeathSignal(*syscall.SysProcAttr) {}
