package openai

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// maxResponseBytes bounds a response body read into memory.
const maxResponseBytes = 256 << 20

// HTTPError is a server's answer with a status other than 2xx.
type HTTPError struct {
	Method  string
	URL     string
	Status  int
	Message string // the error JSON's message, or the start of the body
	Retried int    // attempts before this one
}

// Error says the request, the status and the server's message, and the retries before it.
func (e *HTTPError) Error() string {
	s := fmt.Sprintf("%s %s: HTTP %d %s: %s", e.Method, e.URL, e.Status, http.StatusText(e.Status), e.Message)
	if e.Retried > 0 {
		s += fmt.Sprintf(" (after %d retries)", e.Retried)
	}
	switch e.Status {
	case http.StatusUnauthorized, http.StatusForbidden:
		s += "; check the API key (engine.api_key_env)"
	case http.StatusNotFound:
		s += "; check base_url (it ends in /v1 for most servers) and model"
	case http.StatusTooManyRequests:
		s += "; the server is rate-limiting: lower engine.max_concurrency or raise engine.max_retries"
	}
	return s
}

func asHTTPError(err error, target **HTTPError) bool { return errors.As(err, target) }

// retryable reports whether a status is worth another attempt: the server was overloaded, rate
// limiting, or failed on its side.
func retryable(status int) bool {
	switch status {
	case http.StatusRequestTimeout, http.StatusConflict, http.StatusTooManyRequests,
		http.StatusInternalServerError, http.StatusBadGateway, http.StatusServiceUnavailable, http.StatusGatewayTimeout:
		return true
	}
	return false
}

// call sends one API request (body nil: none) and decodes the JSON answer into out, retrying
// what retryable allows, timeouts and broken connections up to MaxRetries times with exponential
// backoff and jitter, or after what Retry-After asks. Every error names the server.
func (e *Engine) call(ctx context.Context, method, url string, body, out any) error {
	err := e.callOnce(ctx, method, url, body, out)
	if err != nil {
		return fmt.Errorf("openai engine at %s: %w", e.base, err)
	}
	return nil
}

func (e *Engine) callOnce(ctx context.Context, method, url string, body, out any) error {
	if e.closed.Load() {
		return errors.New("the engine is closed")
	}
	name := strings.TrimPrefix(url, e.base+"/") // for messages, which name the server already
	var data []byte
	if body != nil {
		var err error
		if data, err = json.Marshal(body); err != nil {
			return fmt.Errorf("%s: encoding the request: %w", name, err)
		}
	}
	began := time.Now()
	for attempt := 0; ; attempt++ {
		status, header, resp, err := e.attempt(ctx, method, url, data)
		if err == nil && status/100 == 2 {
			if err := json.Unmarshal(resp, out); err != nil {
				return fmt.Errorf("%s %s: the server's answer is not the JSON expected (%v): %s", method, name, err, snippet(resp))
			}
			return nil
		}
		if ctx.Err() != nil {
			return fmt.Errorf("%s %s: %w (after %d attempts over %s)", method, name, ctx.Err(), attempt+1, time.Since(began).Round(time.Millisecond))
		}
		var wait time.Duration
		if err != nil {
			err = fmt.Errorf("%s %s: %w", method, name, err)
		} else {
			err = &HTTPError{Method: method, URL: name, Status: status, Message: errorMessage(resp), Retried: attempt}
			if !retryable(status) {
				return err
			}
			wait = retryAfter(header, time.Now())
		}
		if attempt >= e.o.MaxRetries {
			if attempt > 0 {
				var he *HTTPError
				if !errors.As(err, &he) {
					err = fmt.Errorf("%w (after %d retries over %s)", err, attempt, time.Since(began).Round(time.Millisecond))
				}
			}
			return err
		}
		if wait <= 0 {
			wait = e.backoff(attempt)
		}
		wait = min(wait, e.o.MaxRetryAfter)
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("%w; the call's context ended while waiting %s to retry: %w", err, wait.Round(time.Millisecond), ctx.Err())
		case <-t.C:
		}
	}
}

// attempt makes one HTTP request under the per-attempt timeout. A transport error (refused
// connection, reset, timeout) comes back as err; any answer as status, header and body.
func (e *Engine) attempt(ctx context.Context, method, url string, data []byte) (int, http.Header, []byte, error) {
	actx, cancel := context.WithTimeout(ctx, e.o.Timeout)
	defer cancel()
	var rd io.Reader
	if data != nil {
		rd = bytes.NewReader(data)
	}
	req, err := http.NewRequestWithContext(actx, method, url, rd)
	if err != nil {
		return 0, nil, nil, err
	}
	if data != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	req.Header.Set("Accept", "application/json")
	if e.o.APIKey != "" {
		req.Header.Set("Authorization", "Bearer "+e.o.APIKey)
	}
	resp, err := e.client.Do(req)
	if err == nil {
		var body []byte
		body, err = io.ReadAll(io.LimitReader(resp.Body, maxResponseBytes+1))
		resp.Body.Close()
		if err == nil && len(body) > maxResponseBytes {
			return 0, nil, nil, fmt.Errorf("the answer is over %d MiB", maxResponseBytes>>20)
		}
		if err == nil {
			return resp.StatusCode, resp.Header, body, nil
		}
	}
	if ctx.Err() == nil && errors.Is(actx.Err(), context.DeadlineExceeded) {
		return 0, nil, nil, fmt.Errorf("no complete answer within the timeout of %s (engine.timeout)", e.o.Timeout)
	}
	var ue interface{ Unwrap() error }
	if errors.As(err, &ue) && ue.Unwrap() != nil {
		err = ue.Unwrap() // drop the url.Error's repetition of method and URL
	}
	return 0, nil, nil, err
}

// backoff is the wait before retry attempt+1: exponential from MinBackoff up to MaxBackoff,
// drawn uniformly from its upper half so that clients that failed together do not retry together.
func (e *Engine) backoff(attempt int) time.Duration {
	d := e.o.MaxBackoff
	if attempt < 30 {
		d = min(e.o.MinBackoff<<attempt, e.o.MaxBackoff)
	}
	return d/2 + rand.N(d/2+1)
}

// retryAfter reads how long a server asks to wait: retry-after-ms (OpenAI's), else Retry-After
// in seconds or as an HTTP date; 0 when it asks nothing.
func retryAfter(h http.Header, now time.Time) time.Duration {
	if v := h.Get("Retry-After-Ms"); v != "" {
		if ms, err := strconv.ParseFloat(v, 64); err == nil && ms > 0 {
			return time.Duration(ms * float64(time.Millisecond))
		}
	}
	v := h.Get("Retry-After")
	if v == "" {
		return 0
	}
	if s, err := strconv.ParseFloat(v, 64); err == nil && s > 0 {
		return time.Duration(s * float64(time.Second))
	}
	if t, err := http.ParseTime(v); err == nil && t.After(now) {
		return t.Sub(now)
	}
	return 0
}

// errorMessage is the message of an error answer: the API's {"error": {"message": …}} (or a
// plain {"error": "…"}, {"detail": …}, as some servers send), else the start of the body.
func errorMessage(body []byte) string {
	var eb struct {
		Error  json.RawMessage `json:"error"`
		Detail json.RawMessage `json:"detail"`
		Msg    string          `json:"message"`
	}
	if json.Unmarshal(body, &eb) == nil {
		var ae apiError
		if json.Unmarshal(eb.Error, &ae) == nil && ae.Message != "" {
			return ae.Message
		}
		var s string
		if json.Unmarshal(eb.Error, &s) == nil && s != "" {
			return s
		}
		if len(eb.Detail) > 0 {
			return snippet(eb.Detail)
		}
		if eb.Msg != "" {
			return eb.Msg
		}
	}
	if len(bytes.TrimSpace(body)) == 0 {
		return "(empty body)"
	}
	return snippet(body)
}

// snippet is the start of a body, for an error message.
func snippet(b []byte) string {
	s := strings.TrimSpace(string(b))
	if len(s) > 300 {
		s = s[:300] + "…"
	}
	return strconv.Quote(s)
}
