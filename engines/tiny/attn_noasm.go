//go:build !amd64 || purego

package tiny

import "unsafe"

// Go versions of attn_amd64.s, the same sums in the same order; without assembly haveSIMD is
// false and the engine uses its own loops, so these only keep the callers building.

func f32At(p *float32, off uintptr) *float32 { return (*float32)(unsafe.Add(unsafe.Pointer(p), off)) }

func attnOut16(out, p, v *float32, stride uintptr, n, groups int) {
	for c := range uintptr(16 * groups) {
		var s float32
		for j := range uintptr(n) {
			s += float32(*f32At(p, 4*j) * *f32At(v, j*stride+4*c))
		}
		*f32At(out, 4*c) = s
	}
}

func attnGradRow16(n int, cs, p, keys, dk, dv *float32, stride uintptr, q, do, dq *float32, groups int) {
	for c := range uintptr(16 * groups) {
		var s float32
		for j := range uintptr(n) {
			cj, pj := *f32At(cs, 4*j), *f32At(p, 4*j)
			s += float32(cj * *f32At(keys, j*stride+4*c))
			*f32At(dk, j*stride+4*c) += float32(cj * *f32At(q, 4*c))
			*f32At(dv, j*stride+4*c) += float32(pj * *f32At(do, 4*c))
		}
		*f32At(dq, 4*c) = s
	}
}
