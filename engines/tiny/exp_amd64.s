//go:build !purego

#include "textflag.h"

// EXPCONSTS loads expConsts (address in DX) into Y8-Y15 and the index mask into X7.
#define EXPCONSTS \
	VBROADCASTSD 0(DX), Y8; \
	VBROADCASTSD 8(DX), Y9; \
	VBROADCASTSD 16(DX), Y10; \
	VBROADCASTSD 24(DX), Y11; \
	VBROADCASTSD 80(DX), Y12; \
	VBROADCASTSD 88(DX), Y13; \
	VBROADCASTSD 72(DX), Y14; \
	MOVQ $1023, R9; \
	MOVQ R9, X15; \
	VPBROADCASTQ X15, Y15; \
	MOVL $31, R9; \
	MOVL R9, X7; \
	VPBROADCASTD X7, X7;

// EXP4 sets Y2 to exp64 of the 4 values of Y0 (within [c[10], c[11]]), clobbering Y1-Y6; it
// needs the constants EXPCONSTS loads and the table's address in R8. Each operation is one of
// exp64's, rounded alone, in exp64's order.
#define EXP4 \
	VMULPD Y8, Y0, Y1; \
	VADDPD Y9, Y1, Y1; \
	VROUNDPD $1, Y1, Y1; \
	VMULPD Y10, Y1, Y2; \
	VSUBPD Y2, Y0, Y2; \
	VMULPD Y11, Y1, Y3; \
	VSUBPD Y3, Y2, Y2; \
	VBROADCASTSD 32(DX), Y3; \
	VMULPD Y3, Y2, Y3; \
	VBROADCASTSD 40(DX), Y4; \
	VADDPD Y4, Y3, Y3; \
	VMULPD Y3, Y2, Y3; \
	VBROADCASTSD 48(DX), Y4; \
	VADDPD Y4, Y3, Y3; \
	VMULPD Y3, Y2, Y3; \
	VBROADCASTSD 56(DX), Y4; \
	VADDPD Y4, Y3, Y3; \
	VMULPD Y3, Y2, Y3; \
	VBROADCASTSD 64(DX), Y4; \
	VADDPD Y4, Y3, Y3; \
	VMULPD Y3, Y2, Y3; \
	VADDPD Y14, Y3, Y3; \
	VMULPD Y3, Y2, Y3; \
	VADDPD Y14, Y3, Y3; \
	VCVTPD2DQY Y1, X4; \
	VPAND X7, X4, X5; \
	VPCMPEQD Y6, Y6, Y6; \
	VXORPD Y2, Y2, Y2; \
	VGATHERDPD Y6, (R8)(X5*8), Y2; \
	VMULPD Y3, Y2, Y2; \
	VPSRAD $5, X4, X4; \
	VPMOVSXDQ X4, Y4; \
	VPADDQ Y15, Y4, Y4; \
	VPSLLQ $52, Y4, Y4; \
	VMULPD Y4, Y2, Y2;


// func expBlocks(dst, src *float64, n int, c *[12]float64, tbl *[32]uint64) int
//
// exp64 of 4 values at a time, the same operations in the same order as exp64 in mathf.go (each
// product and sum rounded on its own, never fused), so each lane has exp64's bits. It stops at the
// first block of 4 with a value outside [c[10], c[11]] (or a NaN) and returns how many values it
// did; the caller does that block with exp64. n is a multiple of 4.
TEXT ·expBlocks(SB), NOSPLIT, $0-48
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	MOVQ c+24(FP), DX
	MOVQ tbl+32(FP), R8
	XORQ AX, AX
	EXPCONSTS

loop:
	CMPQ AX, CX
	JGE done
	VMOVUPD (SI)(AX*8), Y0
	VCMPPD $13, Y12, Y0, Y1 // x >= lo (false for NaN)
	VCMPPD $2, Y13, Y0, Y2  // x <= hi
	VANDPD Y2, Y1, Y1
	VMOVMSKPD Y1, R10
	CMPQ R10, $15
	JNE done

	EXP4
	VMOVUPD Y2, (DI)(AX*8)
	ADDQ $4, AX
	JMP loop

done:
	VZEROUPPER
	MOVQ AX, ret+40(FP)
	RET

// func swigluBlocks(act, sig, gate, up *float32, n int, c *[12]float64, tbl *[32]uint64) int
//
// SwiGLU 4 at a time, as swiglu computes it: s = float32(sigmoidExp(g, exp64(−|g|))) in float64,
// act = float32(g·s)·up. It stops at the first block with a gate whose −|g| is outside expBlocks'
// range (or a NaN) and returns how many it did. n is a multiple of 4.
TEXT ·swigluBlocks(SB), NOSPLIT, $0-64
	MOVQ act+0(FP), DI
	MOVQ sig+8(FP), BX
	MOVQ gate+16(FP), SI
	MOVQ up+24(FP), R11
	MOVQ n+32(FP), CX
	MOVQ c+40(FP), DX
	MOVQ tbl+48(FP), R8
	XORQ AX, AX
	EXPCONSTS

sloop:
	CMPQ AX, CX
	JGE sdone
	VCVTPS2PD (SI)(AX*4), Y0 // g, exactly
	VXORPD Y1, Y1, Y1
	VSUBPD Y0, Y1, Y1        // −g
	VMINPD Y0, Y1, Y0        // −|g| (min(−g, g); −0 for ±0: exp64 gives 1 either way)
	VCMPPD $13, Y12, Y0, Y1  // ≥ lowest (false for NaN)
	VMOVMSKPD Y1, R10
	CMPQ R10, $15
	JNE sdone
	EXP4                     // Y2 = e = exp64(−|g|)
	VADDPD Y14, Y2, Y5       // 1 + e
	VCVTPS2PD (SI)(AX*4), Y1
	VXORPD Y3, Y3, Y3
	VCMPPD $13, Y3, Y1, Y1   // g ≥ 0
	VBLENDVPD Y1, Y14, Y2, Y4 // g ≥ 0 ? 1 : e
	VDIVPD Y5, Y4, Y4        // sigmoid
	VCVTPD2PSY Y4, X4        // s = float32
	VMOVUPS X4, (BX)(AX*4)
	VMOVUPS (SI)(AX*4), X5
	VMULPS X4, X5, X5        // float32(g·s)
	VMULPS (R11)(AX*4), X5, X5 // ·up
	VMOVUPS X5, (DI)(AX*4)
	ADDQ $4, AX
	JMP sloop

sdone:
	VZEROUPPER
	MOVQ AX, ret+56(FP)
	RET
