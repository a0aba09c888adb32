// Package loopback picks loopback addresses that a server can give up and take again.
//
// A port the kernel hands out for "127.0.0.1:0" lies in its ephemeral range, the range it also
// draws clients' source ports from. A server that dies and is started again on the same port
// (a torch worker after a crash, a test's killed server) races every outgoing connection on the
// machine meanwhile, its own clients' redials included (which can even connect to themselves):
// when one of them takes the port as its source, the new server fails with "address already in
// use". A port below the ephemeral range is never given to a client, so only another listener
// can take it.
package loopback

import (
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
)

var (
	mu     sync.Mutex
	handed = map[int]bool{} // the ports Addr returned in this process: two servers it starts at once never get the same one
)

// Addr returns "127.0.0.1:PORT" with a port that is free now, not returned before in this process
// and, where Linux's ephemeral range can be read, below it; elsewhere a port the kernel picks.
// The caller's server binds it a moment later: between the two, only another process's listener
// on the same random port can take it.
func Addr() (string, error) {
	lo := ephemeralLow()
	mu.Lock()
	defer mu.Unlock()
	for try := 0; lo > 2048 && try < 200; try++ {
		port := 1024 + rand.IntN(lo-1024)
		if handed[port] {
			continue
		}
		addr := "127.0.0.1:" + strconv.Itoa(port)
		if l, err := net.Listen("tcp", addr); err == nil {
			l.Close()
			handed[port] = true
			return addr, nil
		}
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer l.Close()
	return l.Addr().String(), nil
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
