//go:build !unix

package torchproc

import (
	"os"
	"os/exec"
)

func setProcAttr(*exec.Cmd) {}

func terminate(cmd *exec.Cmd) { cmd.Process.Signal(os.Interrupt) }

func kill(cmd *exec.Cmd) { cmd.Process.Kill() }
