package api

import (
	"context"
	"testing"
	"time"
)

func TestStepsHeaderRoundTrip(t *testing.T) {
	s := NewSteps(time.Now().Add(-3 * time.Millisecond))
	s.Mark("decode")
	s.Add("read", 1500*time.Microsecond)
	s.Mark("journal")
	got := ParseTiming(s.Header())
	want := s.List()
	if len(got) != 3 || len(want) != 3 {
		t.Fatalf("parsed %v from %q, want 3 steps", got, s.Header())
	}
	for i := range want {
		if got[i].Name != want[i].Name {
			t.Errorf("step %d: %q, want %q", i, got[i].Name, want[i].Name)
		}
		// The header has microseconds.
		if d := got[i].Dur - want[i].Dur; d < -time.Microsecond || d > time.Microsecond {
			t.Errorf("step %s: %v, want %v", want[i].Name, got[i].Dur, want[i].Dur)
		}
	}
	if got[0].Dur < 3*time.Millisecond {
		t.Errorf("decode %v: the first mark must count from the start", got[0].Dur)
	}
}

func TestParseTimingSkipsJunk(t *testing.T) {
	got := ParseTiming(`a;dur=1.5, , b;desc="x";dur=oops, c`)
	if len(got) != 3 || got[0] != (Step{"a", 1500 * time.Microsecond}) || got[1] != (Step{"b", 0}) || got[2] != (Step{"c", 0}) {
		t.Errorf("got %v", got)
	}
}

func TestNilStepsIgnoresCalls(t *testing.T) {
	var s *Steps
	s.Mark("x")
	s.Add("y", time.Second)
	if s.List() != nil || StepsFrom(context.Background()) != nil {
		t.Error("a nil Steps must record nothing")
	}
}
