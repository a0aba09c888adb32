//go:build !purego

package tiny

import "golang.org/x/sys/cpu"

// haveSIMD reports whether the packed kernels of matmul_amd64.s can run: they use AVX2 (8-lane
// VMULPS/VADDPS, no FMA). Tests turn it off to compare with the portable kernel.
var haveSIMD = cpu.X86.HasAVX2

// mmKernel6x16 sets (acc: adds to) the 6×16 tile of c at c (row stride ldc bytes) to the product
// of 6 rows of a (element (i, x) at a + i·rsa + x·csa bytes) with one 16-column panel of B.
//
//go:noescape
func mmKernel6x16(k int, a *float32, rsa, csa uintptr, b *float32, c *float32, ldc uintptr, acc bool)

// mmKernel1x64 does the same for one row of a and 4 consecutive panels (ps bytes apart), writing
// 64 contiguous elements of c.
//
//go:noescape
func mmKernel1x64(k int, a *float32, csa uintptr, b *float32, ps uintptr, c *float32, acc bool)

// mmKernel1x16 does it for one row of a and one panel.
//
//go:noescape
func mmKernel1x16(k int, a *float32, csa uintptr, b *float32, c *float32, acc bool)
