//go:build !amd64 || purego

package tiny

import "unsafe"

// haveSIMD is false without assembly: the engine uses the portable kernel of matmul.go. The panel
// kernels below are the same computation in Go, so the panel code path builds and can be tested
// on every platform.
var haveSIMD = false

func mmKernelGo(rows, cols, k int, a *float32, rsa, csa uintptr, b *float32, ps uintptr, c *float32, ldc uintptr, acc bool) {
	for i := range rows {
		for j := range cols {
			p, jj := uintptr(j/mmPanel), uintptr(j%mmPanel)
			cp := (*float32)(unsafe.Add(unsafe.Pointer(c), uintptr(i)*ldc+uintptr(j)*4))
			var s float32
			if acc {
				s = *cp
			}
			for x := range uintptr(k) {
				av := *(*float32)(unsafe.Add(unsafe.Pointer(a), uintptr(i)*rsa+x*csa))
				bv := *(*float32)(unsafe.Add(unsafe.Pointer(b), p*ps+(x*mmPanel+jj)*4))
				s += float32(av * bv)
			}
			*cp = s
		}
	}
}

func mmKernel6x16(k int, a *float32, rsa, csa uintptr, b *float32, c *float32, ldc uintptr, acc bool) {
	mmKernelGo(6, 16, k, a, rsa, csa, b, 0, c, ldc, acc)
}

func mmKernel1x64(k int, a *float32, csa uintptr, b *float32, ps uintptr, c *float32, acc bool) {
	mmKernelGo(1, 64, k, a, 0, csa, b, ps, c, 0, acc)
}

func mmKernel1x16(k int, a *float32, csa uintptr, b *float32, c *float32, acc bool) {
	mmKernelGo(1, 16, k, a, 0, csa, b, 0, c, 0, acc)
}
