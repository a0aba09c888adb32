// Package testaddr gives tests a loopback address that a server can give up and take again.
//
// A port the kernel hands out for "127.0.0.1:0" lies in its ephemeral range, the range it also
// draws clients' source ports from. A test that kills a server and starts it again on the same
// port races every outgoing connection on the machine meanwhile (the client's own redials
// included, which can connect to themselves): when one of them takes the port as its source, the
// restarted server fails with "address already in use". A port below the ephemeral range is
// never given to a client, so only another listener can take it.
package testaddr

import (
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
	"testing"
)

// Restartable returns "127.0.0.1:PORT" with a port that is free now and outside the kernel's
// ephemeral range (where the range cannot be read, a port the kernel picks).
func Restartable(t testing.TB) string {
	t.Helper()
	lo := ephemeralLow()
	for try := 0; lo > 2048 && try < 200; try++ {
		addr := "127.0.0.1:" + strconv.Itoa(1024+rand.IntN(lo-1024))
		if l, err := net.Listen("tcp", addr); err == nil {
			l.Close()
			return addr
		}
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// ephemeralLow is the first port of Linux's ephemeral range, 0 where it cannot be read.
func ephemeralLow() int {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b))
	if len(f) != 2 {
		return 0
	}
	lo, err := strconv.Atoi(f[0])
	if err != nil {
		return 0
	}
	return lo
}
